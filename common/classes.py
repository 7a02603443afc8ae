"""The sentiment classes in the model's output order (index 0 negative, 1 positive).

A module of its own, free of TensorFlow, so the server's HTTP layer can name the classes without
importing the model code.
"""

CLASS_NAMES: tuple[str, str] = ("negative", "positive")
