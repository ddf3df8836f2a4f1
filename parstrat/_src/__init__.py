"""The implementation of parstrat; the public API is the `parstrat` package."""
