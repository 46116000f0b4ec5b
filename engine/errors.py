"""Errors the engine raises for bad input. Each names what was wrong."""


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) is invalid; `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelLoadError(RuntimeError):
    """A model could not be resolved or loaded; `source` names the path or alias."""

    def __init__(self, source: str, message: str):
        super().__init__(f"{source}: {message}")
        self.source = source


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a tensor/pipeline-parallel rank died or stopped
    answering): its process should fail what it holds and exit, not keep serving."""
