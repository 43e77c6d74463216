"""flagos analyze (being written)."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    raise NotImplementedError("flagos analyze")


def analyze(*args, **kwargs):
    raise NotImplementedError("flagos analyze")
