"""The project's own error types: each says what failed and where, for a message without a traceback."""


class VocagnoError(Exception):
    """Base class; the CLI prints these as one clear line and exits non-zero."""


class TokenizerError(VocagnoError):
    """A tokenizer could not be loaded, or cannot give character offsets."""


class CorpusError(VocagnoError):
    """A corpus file or record is unreadable or malformed."""


class CacheError(VocagnoError):
    """A cache (shards or manifest) is missing, corrupt, or from a different producer."""


class ConfigError(VocagnoError):
    """Invalid options or manifest."""
