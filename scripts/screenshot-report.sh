#!/usr/bin/env bash
# A PNG of a report's first screens as a laptop shows them (headless Chromium, 1280 px wide), for READMEs and
# slides:   scripts/screenshot-report.sh runs/process-vs-outcome/report.html docs/report.png [HEIGHT]
set -euo pipefail
report=${1:?usage: screenshot-report.sh REPORT.html OUT.png [HEIGHT]}
out=${2:?usage: screenshot-report.sh REPORT.html OUT.png [HEIGHT]}
height=${3:-1600}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then echo "screenshot-report.sh: chromium not found (apt-get install chromium)" >&2; exit 1; fi
[ -f "$report" ] || { echo "screenshot-report.sh: $report: no such file" >&2; exit 1; }
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
  --host-resolver-rules="MAP * ~NOTFOUND" --window-size="1280,$height" \
  --screenshot="$(realpath -m "$out")" "file://$(realpath "$report")" 2>/dev/null
echo "$out"
