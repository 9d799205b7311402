#!/usr/bin/env bash
# Install a headless browser for the HTML report test (tests/test_reports.py): Debian's `chromium`.
# Called by .ci/run before the tests. It never fails the build: where it cannot install (not root, no
# apt-get, no network), it says why and exits 0, and the browser test skips with its own reason.
set -u

if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then
  echo "install_test_browser: chromium already present: $(command -v chromium || echo /usr/bin/chromium)"
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "install_test_browser: not root; skipping (install Debian's 'chromium' to run the HTML report browser test)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_test_browser: no apt-get here; skipping (install a 'chromium' binary to run the browser test)"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
if ! apt-get update -q; then
  echo "install_test_browser: apt-get update failed; skipping (the browser test will skip)"
  exit 0
fi
if ! apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core; then
  echo "install_test_browser: apt-get install chromium failed; skipping (the browser test will skip)"
  exit 0
fi
echo "install_test_browser: installed $(chromium --version 2>/dev/null || echo chromium)"
exit 0
