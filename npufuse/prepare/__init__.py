"""Before matching: admission, normalisation (names, order, shapes, constants) and canonicalisation to one form."""
