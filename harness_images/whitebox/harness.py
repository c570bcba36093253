#!/usr/bin/env python3
"""bridle's white-box harness: the entry script. The harness is the package ``agent/`` beside this file
(standard library only); README.md beside it describes the command line and the five components.

Runs as ``python3 harness.py --config S0T1O2C1W0 ...``, locally from the checkout or as
``/opt/bridle/whitebox/harness.py`` in the ``bridle-whitebox`` image. Run as a script, this file's folder is
first on ``sys.path`` and the package is the top-level ``agent``; imported as
``harness_images.whitebox.harness``, it is the subpackage beside it.
"""

import sys

if __package__:
    from .agent.cli import main
else:
    from agent.cli import main

if __name__ == "__main__":
    sys.exit(main())
