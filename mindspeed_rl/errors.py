"""The one exception type for a configuration that cannot work, and how several are reported together."""

from collections.abc import Callable, Sequence


class ConfigError(ValueError):
    """A config value that cannot work, named by its full dotted key.

    ``str(error)`` is ``"<full.key.path>: <message>"`` so the CLI can print it as one line, e.g.
    ``actor_config.tensor_model_parallel_size: must divide rl_config.actor_resource.num_npus=16, got 3``.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message

    def all(self) -> list["ConfigError"]:
        """Every error this one stands for (itself; a ConfigErrors lists several)."""
        return [self]

    def __reduce__(self) -> tuple[type["ConfigError"], tuple[str, str]]:
        # Ray pickles exceptions between processes; the default reduce would call the constructor
        # with the single formatted string and fail.
        return (type(self), (self.key, self.message))


class ConfigErrors(ConfigError):
    """Every error of one config, so that a user fixes them in one go instead of one run per key.
    ``str()`` is one ``key: message`` per line; ``key``/``message`` are the first error's."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        # Checks that read one shared derived value (the resource plan) fail on it alike: said once.
        unique = {str(leaf): leaf for error in errors for leaf in error.all()}
        self.errors = list(unique.values())
        ValueError.__init__(self, "\n".join(str(error) for error in self.errors))
        self.key = self.errors[0].key
        self.message = self.errors[0].message

    def all(self) -> list[ConfigError]:
        return list(self.errors)

    def __reduce__(self) -> tuple[type["ConfigErrors"], tuple[list[ConfigError]]]:  # type: ignore[override]
        return (type(self), (self.errors,))


def raise_together(errors: Sequence[ConfigError]) -> None:
    """Raise nothing, the one error, or all of them (each once) as one ConfigErrors."""
    if not errors:
        return
    together = ConfigErrors(errors)
    raise together.errors[0] if len(together.errors) == 1 else together


def run_checks(*checks: Callable[[], None]) -> None:
    """Run every check and raise all their ConfigErrors together.

    Checks may read values an earlier check found invalid; once one has failed, a later check that
    breaks on some other exception is taken as a consequence of that error and not reported (else
    a bad tensor-parallel size would end in a ZeroDivisionError traceback instead of its own line).
    """
    errors: list[ConfigError] = []
    for check in checks:
        try:
            check()
        except ConfigError as error:
            errors.append(error)
        except Exception:
            if not errors:
                raise
    raise_together(errors)


def error_lines(error: ConfigError) -> list[str]:
    """What a CLI prints: ``config error: <key>: <message>``, one line per error."""
    return [f"config error: {each}" for each in error.all()]
