#!/usr/bin/env bash
# Real-terminal check of `pdtrace view`: run it in a detached tmux session, wait for the
# detectors, capture the pane text and require EXPECTED (default: any finding kind) on
# screen. Exit 0 when it is shown, 1 when not (the capture is printed), 2 on usage errors.
#   scripts/tmux_view_check.sh TRACE [EXPECTED] [TIMEOUT_S]
set -u
TRACE=${1:?usage: tmux_view_check.sh TRACE [EXPECTED] [TIMEOUT_S]}
EXPECTED=${2:-}
TIMEOUT=${3:-30}
command -v tmux >/dev/null || { echo "tmux not installed"; exit 2; }
PDTRACE=${PDTRACE:-pdtrace}
command -v "$PDTRACE" >/dev/null || { echo "$PDTRACE not on PATH"; exit 2; }
SESSION="pdtrace-view-check-$$"
SOCK="pdtrace-check-$$"
cleanup() { tmux -L "$SOCK" kill-server 2>/dev/null || true; }
trap cleanup EXIT
tmux -L "$SOCK" new-session -d -s "$SESSION" -x 160 -y 45 \
    "TERM=xterm-256color $PDTRACE view '$TRACE'; echo pdtrace-exited-\$?; sleep 30"
deadline=$(( $(date +%s) + TIMEOUT ))
screen=""
while [ "$(date +%s)" -lt "$deadline" ]; do
    sleep 0.5
    screen=$(tmux -L "$SOCK" capture-pane -p -t "$SESSION" 2>/dev/null || true)
    # the findings box title reads "Findings (N)" once the detectors reported
    if grep -q "Findings (" <<<"$screen" && ! grep -q "running detectors\|indexing\.\.\." <<<"$screen"; then
        break
    fi
    grep -q "pdtrace-exited-" <<<"$screen" && break
done
sleep 0.3
screen=$(tmux -L "$SOCK" capture-pane -p -t "$SESSION" 2>/dev/null || true)
tmux -L "$SOCK" send-keys -t "$SESSION" q 2>/dev/null || true
echo "$screen"
if grep -q "no findings" <<<"$screen"; then
    echo "tmux_view_check: no findings on screen"
fi
if [ -n "$EXPECTED" ]; then
    grep -qF -- "$EXPECTED" <<<"$screen" && { echo "tmux_view_check: OK, '$EXPECTED' shown"; exit 0; }
else
    grep -qE "lookahead-block-misalignment|connector-metadata-cleared-before-drafter|drafter-window-outside-allocation|stale-accepted-count-read|kv-load-failure-recovery|kv-never-crossed|kv-invariant" <<<"$screen" \
        && { echo "tmux_view_check: OK, a finding is shown"; exit 0; }
fi
echo "tmux_view_check: FAILED: expected finding not on screen"
exit 1
