#!/usr/bin/env bash
# The README's bootstrap on a fresh clone: `make venv` in a temporary clone of the committed HEAD, then the
# agents' code tool in both confinements with the packages a data-science snippet needs. A step that only a
# developer's machine has (a package installed by hand, a file outside git) makes this fail.
set -euo pipefail
src=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$src" "$work/clone"
cd "$work/clone"
echo "fresh clone of $(git rev-parse --short HEAD) in $work/clone"
start=$(date +%s)
make venv > "$work/bootstrap.log" 2>&1 || { tail -30 "$work/bootstrap.log"; echo "fresh bootstrap: make venv failed"; exit 1; }
echo "bootstrap: $(( $(date +%s) - start )) s"
cat > "$work/snippet.py" <<'PY'
import pickle

import pandas as pd
from sklearn.linear_model import LogisticRegression

df = pd.DataFrame({"x": [0.0, 1.0, 2.0, 3.0], "label": ["a", "a", "b", "b"]})
model = LogisticRegression().fit(df[["x"]], df["label"])
print("predicted", pickle.loads(pickle.dumps(model)).predict(df[["x"]]).tolist())
PY
for mode in auto fallback; do
  out=$(.venv/bin/mappa sandbox run "$work/snippet.py" --confinement "$mode" 2>"$work/stderr") \
    || { cat "$work/stderr"; echo "$out"; echo "fresh bootstrap: sandbox run ($mode) failed"; exit 1; }
  grep -q "predicted" <<<"$out" || { cat "$work/stderr"; echo "$out"; echo "fresh bootstrap: snippet ($mode) did not run"; exit 1; }
  echo "sandbox ($mode): $(head -1 "$work/stderr")"
done
echo "fresh bootstrap: ok"
