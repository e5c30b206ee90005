"""The dispatcher's clients of the other control-plane services: the inventory and the compiler."""
