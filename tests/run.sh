#!/usr/bin/env bash
# Set up .venv (first run only) and run the whole test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash serve/setup.sh
exec .venv/bin/python -m pytest -q -rs tests "$@"
