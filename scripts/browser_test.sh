#!/usr/bin/env bash
# Runs the browser demo's end-to-end test (tests/test_demo_browser.py) in headless Chromium.
# Installs what it lacks first: Debian's chromium and chromium-driver (apt, as root or through
# sudo; ~20 s and ~500 MB on a Debian 12 box with a reachable mirror) and Selenium (pip). No
# browser is downloaded by Selenium or Playwright: the test drives /usr/bin/chromium through
# /usr/bin/chromedriver. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x /usr/bin/chromium || ! -x /usr/bin/chromedriver ]]; then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium chromium-driver
fi
python -c "import selenium" 2>/dev/null || pip install -q "selenium>=4.10"
# -rs shows a skip's reason; the test skips only when the installs above failed
exec python -m pytest -q -rs tests/test_demo_browser.py "$@"
