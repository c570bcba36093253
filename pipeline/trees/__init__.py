"""From calls to training data: the settling collector, prefix trees, packing."""
