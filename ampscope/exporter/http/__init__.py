"""The HTTP plumbing under the app, hardened: the server with the limits uvicorn lacks,
bounded body reads, and bounded parsing of ingest bodies."""
