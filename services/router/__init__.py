"""The router service: OpenAI-compatible HTTP API, admission, streaming (docs/ARCHITECTURE.md, Processes).

`create_app(RouterConfig(...))` builds the FastAPI app; `main(argv)` runs it under uvicorn.
"""

from services.router.app import create_app
from services.router.config import RouterConfig, WorkerPair
from services.router.core import RouterCore
from services.router.main import main

__all__ = ["RouterConfig", "RouterCore", "WorkerPair", "create_app", "main"]
