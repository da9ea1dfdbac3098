"""The one error type for bad user input (config values, files, checkpoints).

`train.py` catches it and prints exactly one line, ``error: <message>``, then exits with
code 2. The message must name the config key or file and say what would be valid.
"""


class ConfigError(Exception):
    """Bad input from the user: one line, names the key/file, lists valid choices."""

    exit_code = 2

    def __init__(self, message: str):
        # Errors are printed on one line; collapse any newlines a caller let through.
        super().__init__(" ".join(str(message).split()))
