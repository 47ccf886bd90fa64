#!/usr/bin/env bash
# Set up .venv (first run only), check lint, formatting, types and the shell scripts, then run the whole test
# suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash serve/setup.sh
failed() { echo "tests/run.sh: $1 failed (see above), so the tests did not run" >&2; exit 1; }
.venv/bin/ruff check . || failed "ruff check ."
.venv/bin/ruff format --check . || failed "ruff format --check . ('.venv/bin/ruff format .' rewrites it)"
.venv/bin/mypy || failed "mypy (pyproject.toml names what it checks)"
git ls-files -z '*.sh' .ci/run | xargs -0 .venv/bin/shellcheck || failed "shellcheck of the shell scripts"
exec .venv/bin/python -m pytest -q -rs tests "$@"
