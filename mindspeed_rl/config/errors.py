"""The one exception type for a configuration that cannot work."""


class ConfigError(ValueError):
    """A config value that cannot work, named by its full dotted key.

    ``str(error)`` is ``"<full.key.path>: <message>"`` so the CLI can print it as one line, e.g.
    ``actor_config.tensor_model_parallel_size: must divide rl_config.actor_resource.num_npus=16, got 3``.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message

    def __reduce__(self) -> tuple[type["ConfigError"], tuple[str, str]]:
        # Ray pickles exceptions between processes; the default reduce would call the constructor
        # with the single formatted string and fail.
        return (type(self), (self.key, self.message))
