"""Opening input files so that nothing can hang a tool, as microgpt/host/files.h does for the
engines: a FIFO, device or directory given where a file belongs is refused at once, where a plain
open() of a FIFO would wait for a writer for ever."""
import errno
import os
import stat


class NotRegularFile(OSError):
    """An OSError whose strerror says what the file is instead ("a FIFO, not a regular file")."""


def file_kind(mode):
    """What a file that is not a regular file is, for error messages."""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")


def open_regular(path, flags=0):
    """os.open(path, O_RDONLY | flags) of a regular file, its reads blocking as usual; NotRegularFile
    for anything else. O_NONBLOCK makes opening a FIFO return at once; the kind is then read from
    the open descriptor, so a file swapped after a check is not what gets read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"{file_kind(mode)}, not a regular file", path)
    os.set_blocking(fd, True)
    return fd
