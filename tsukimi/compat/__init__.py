"""Drop-in facades for code written against other systems' Python APIs."""
