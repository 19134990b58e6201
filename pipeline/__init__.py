"""vocagno: vocabulary-agnostic teacher-guided language modeling with an offline teacher-loss cache."""

__version__ = "0.1.0"
