#!/usr/bin/env bash
# The browser the live-view test drives (tests/test_live.py): Debian's chromium, installed with
# apt when it is missing. Playwright itself comes with the `test` extra; it drives this binary
# (`playwright install` would need to download a browser).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "setup-browser: no /usr/bin/chromium and no apt-get; the browser test will be skipped" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    SUDO="sudo -n"
fi
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null; }; then
    echo "setup-browser: could not install chromium; the browser test will be skipped" >&2
fi
