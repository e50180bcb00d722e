"""Applications built on the library: the quickstart."""
