"""Where the checkout's own folders are: experiment files and the sandbox image recipes."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs"
HARNESS_IMAGES = REPO / "harness_images"
