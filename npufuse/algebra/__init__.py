"""The shape and layout algebra that canonicalisation and the patterns share: static values, symbolic dims, what a
Reshape/Transpose/Expand chain does to an axis."""
