"""Table-driven stand-ins for hardware libraries, handed to probes in place of the real ones."""
