"""The web UI's static files, installed as the package ``kvmem_webui`` (package data, found through
``importlib.resources``); the server serves this folder."""
