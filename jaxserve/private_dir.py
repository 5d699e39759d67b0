"""Private directories: ones only this user (or root) can change, for what jaxserve trusts on disk (the
compilation cache, whose entries are code; the disk tier of the KV cache)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def _untrusted(info: os.stat_result, directory: bool) -> str | None:
    """Why another user could change what this entry holds or points to (None: only root or this user
    can): it is owned by someone else, or it is a directory that group or others can write without the
    sticky bit (which keeps them from renaming or removing entries they do not own)."""
    if info.st_uid not in (0, os.getuid()):
        return f"is owned by uid {info.st_uid}, neither root nor this user (uid {os.getuid()})"
    if directory and info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"is writable by group or others without the sticky bit (mode {oct(info.st_mode & 0o7777)})"
    return None


def _check_ancestors(directory: Path, path: Path, option: str, fix: str) -> None:
    """`directory` (a real path) and every directory above it that exists: none may let another user
    replace its entries."""
    for ancestor in (directory, *directory.parents):
        if ancestor.exists():
            reason = _untrusted(ancestor.stat(), directory=True)
            if reason is not None:
                raise ValueError(f"{option} {str(path)!r} lies under {str(ancestor)!r}, which {reason}, so another "
                                 f"user could replace what it holds; {fix}")


def private_directory(directory: str, option: str = "runner.compilation_cache_dir", fix: str | None = None) -> Path:
    """`directory` (~ expanded) as its real path, made sure to be this user's alone; missing directories
    are created 0700.

    Whoever can write the compilation cache chooses the code this process runs, so, like ssh's StrictModes,
    refuse a path another user can redirect: a symbolic link on it owned by neither root nor this user,
    or in a directory group or others can write (without the sticky bit); a real path with a directory
    above it owned by another user, or writable by group or others without the sticky bit; and a cache
    directory not owned by this user or writable by group or others. Links owned by root or this user
    in directories only they can change (/home -> /data/home) are followed. An existing directory's mode
    is left as it is."""
    path = Path(os.path.expanduser(directory)).absolute()
    fix = fix or f"set {option} to a directory of your own (or null to disable the persistent cache)"
    current = Path(path.anchor)
    for part in path.parts[1:]:
        current = current / part
        if current.is_symlink():
            container = Path(os.path.realpath(current.parent))
            link_reason = _untrusted(current.lstat(), directory=False)
            reason = link_reason or _untrusted(container.stat(), directory=True)
            if reason is not None:
                where = "it" if link_reason else f"the directory it sits in, {str(container)!r},"
                raise ValueError(f"{option} {str(path)!r} is reached through a symbolic link, {str(current)!r} -> "
                                 f"{os.readlink(current)!r}, that another user could re-point: {where} {reason}; "
                                 f"use the real path ({os.path.realpath(path)!r}) if it is yours, or {fix}")
            _check_ancestors(container, path, option, fix)
        elif not current.exists():
            break  # the rest is created below, on the real path
    real = Path(os.path.realpath(path))
    if real.exists():
        _check_directory(real, path, option, fix)
    _check_ancestors(real.parent, path, option, fix)
    current = Path(real.anchor)
    for part in real.parts[1:]:
        current = current / part
        if not current.exists():
            try:
                current.mkdir(mode=0o700)
                os.chmod(current, 0o700)  # exactly 0700, whatever the umask
            except OSError as err:
                raise ValueError(f"{option} {str(path)!r}: cannot create {str(current)!r} ({err}); {fix}") from None
    _check_directory(real, path, option, fix)
    return real


def _check_directory(real: Path, path: Path, option: str, fix: str) -> None:
    """The cache directory itself: a directory, this user's, writable by no one else."""
    named = repr(str(path)) if real == path else f"{str(path)!r} (really {str(real)!r})"
    info = real.stat()
    if not real.is_dir():
        raise ValueError(f"{option} {named} exists and is not a directory; {fix}")
    if info.st_uid != os.getuid():
        raise ValueError(f"{option} {named} is owned by uid {info.st_uid}, not by this user (uid "
                         f"{os.getuid()}); {fix}")
    if info.st_mode & 0o022:
        raise ValueError(f"{option} {named} is writable by group or others (mode "
                         f"{oct(info.st_mode & 0o777)}); run chmod 700 {str(real)!r} or {fix}")
