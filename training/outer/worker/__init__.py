"""One worker of a decentralised outer-loop run."""

from training.outer.worker.driver import Worker

__all__ = ["Worker"]
