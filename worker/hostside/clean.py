"""The clean verb: empty a directory strictly inside the workspace, walking it by directory fds that never follow
a symlink; a warm restart's draft is moved aside first."""

import errno
import os
import stat

from .files import workspace_moved


def _within(workspace, path):
    """The components of `path` below `workspace` (both as given, and the workspace also resolved), or None."""
    target = os.path.normpath(path)
    for base in (os.path.normpath(workspace), os.path.realpath(workspace)):
        rel = os.path.relpath(target, base)
        if rel != "." and rel != ".." and not rel.startswith(".." + os.sep):
            return rel.split(os.sep)
    return None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _open_below(root_fd, parts, create=False):
    """A directory fd reached from `root_fd` one component at a time, never through a symlink (O_NOFOLLOW):
    a component swapped for a symlink after the check fails with ELOOP/ENOTDIR instead of being followed."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_at(dir_fd, name):
    """Remove `name` in the directory `dir_fd`, a subtree walked by fds (never following a symlink)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=dir_fd)
        return
    try:
        for entry in os.listdir(fd):
            _remove_at(fd, entry)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def clean(req):
    """Empty a directory strictly inside the workspace and outside longrun's records. Every step goes through a
    directory fd opened with O_NOFOLLOW, so no symlink, there from the start or swapped in meanwhile, leads out;
    nor a workspace that no longer leads where it did when the host was registered."""
    moved = workspace_moved(req)
    if moved is not None:
        return {"error": f"clean: {moved}"}
    workspace = os.path.realpath(req["workspace"])
    target = req["path"]
    if workspace == "/":
        return {"error": f"refusing to clean inside the workspace {req['workspace']!r}: it is the root directory"}
    if not os.path.isabs(target):
        return {"error": f"refusing to clean {target!r}: not an absolute path"}
    parts = _within(req["workspace"], target)
    if parts is None:
        return {"error": f"refusing to clean {target}: not strictly inside the host workspace {workspace}"}
    records = _within(req["workspace"], req["records"])
    if records and parts[:len(records)] == records:
        return {"error": f"refusing to clean {target}: it holds longrun's own records"}
    keep_parts = _within(req["workspace"], req["keep_into"]) if req.get("keep_into") else None
    if req.get("keep_into") and keep_parts is None:
        return {"error": f"refusing to keep the draft in {req['keep_into']}: outside the host workspace {workspace}"}
    root = os.open(workspace, _DIR_FLAGS)
    try:
        try:
            fd = _open_below(root, parts)
        except FileNotFoundError:
            return {"removed": 0}
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return {"error": f"refusing to clean {target}: on the way there is a symlink or a file, which could "
                                 f"lead outside the host workspace {workspace}; it is never followed"}
            return {"error": f"refusing to clean {target}: {os.strerror(exc.errno)}"}
        try:
            kept = _keep_draft(root, fd, keep_parts) if keep_parts else []
            names = os.listdir(fd)
            for name in names:
                _remove_at(fd, name)
        finally:
            os.close(fd)
    finally:
        os.close(root)
    return {"removed": len(names), "kept": kept}


def _keep_draft(root, fd, keep_parts):
    # a warm restart starts from the last draft: move it aside before the directory is emptied
    keep = _open_below(root, keep_parts, create=True)
    kept = []
    try:
        for name in ("model.safetensors", "config.json"):
            try:
                if stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.replace(name, name, src_dir_fd=fd, dst_dir_fd=keep)
                    kept.append(name)
            except FileNotFoundError:
                pass
    finally:
        os.close(keep)
    return kept
