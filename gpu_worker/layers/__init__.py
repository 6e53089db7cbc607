"""Building blocks shared by the model files."""
