"""The coordinator as the source of the model's layers, for workers that fetch them."""
