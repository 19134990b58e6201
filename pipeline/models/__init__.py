"""Building models: the student (presets, configs, folders, hub ids) and the shipped teacher
prepared offline from its PyPI wheel."""
