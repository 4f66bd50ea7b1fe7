"""The shape of every resource the tests start (a Slurm cluster, an sshd, a network namespace)."""

from typing import Self


class Resource:
    """A context manager whose `_prepare` checks and claims first, then `_open` builds; if building fails half-way,
    what was made is closed before the error goes on, so no daemon or namespace outlives a failed start."""

    def _prepare(self) -> None:
        """What must hold before anything is made (the tools installed, root); nothing to undo if it fails."""

    def _open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._prepare()
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
