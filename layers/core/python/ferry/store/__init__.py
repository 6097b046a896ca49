"""The shared store: the API database and one database per cell (SQLAlchemy 2)."""
