"""Fuel Serve's OpenAI-compatible HTTP front door (FastAPI + uvicorn).

``server`` depends on ``engine``; never the other way round.
"""

__version__ = "0.1.0"
