"""The data layer's error: a problem with the user's data, naming the file, the line or row, and the fix."""


class DataError(Exception):
    """A problem with the user's data: names the file, the line or row, and what is wrong."""
