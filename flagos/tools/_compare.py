"""flagos compare (being written)."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    raise NotImplementedError("flagos compare")


def compare(*args, **kwargs):
    raise NotImplementedError("flagos compare")
