"""The web page served at `/`: static HTML, CSS and ES modules that call the REST API (no build step)."""

from pathlib import Path

WEB_DIR = Path(__file__).parent
