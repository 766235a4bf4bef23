"""The machinery behind :mod:`lampdist.checkpoint`: format, files, RNG, writer, reader."""
