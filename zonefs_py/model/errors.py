"""The model's one error: an op that does not fit the state it is applied to."""


class StateError(Exception):
    """An op does not fit the state it is applied to (corrupt log or a bug)."""
