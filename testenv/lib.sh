# The cache and the lock of testenv/build.sh and testenv/gpu-operator/build.sh (sourced by both).
#
# A build's outputs go to "$cache_root/$kind/$key" (key: a hash of the build's inputs, this
# file included). A second run with unchanged inputs costs the hash and a stat. Builds of the
# same key take a lock (flock on "$key.lock" beside it): one started while another runs waits
# for it, then uses what it built. Each build writes into a directory of its own ($tmp), moved
# into place at the end, so even without flock two builds never write the same files.
#
# The caller sets name (the log prefix), kind, key and what (the versions, for the log), and
# defines complete DIR (true when DIR holds a finished build). Then:
#   cached_or_locked   # prints the cached directory and exits; or returns holding the lock, $tmp made
#   ...build into $tmp...
#   publish            # moves $tmp into place (or keeps the one another build finished first)
cache_root="${SHARED_SVC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shared-svc}"
started=$(date +%s%N)

# Logs "<name>: $1 <key> (<what>) in <seconds>" to stderr and prints the build's directory.
report() {
  local ms=$(( ($(date +%s%N) - started) / 1000000 ))
  printf '%s: %s %s (%s) in %d.%03ds\n' "$name" "$1" "$key" "$what" $((ms / 1000)) $((ms % 1000)) >&2
  echo "$out"
}

cached_or_locked() {
  out="$cache_root/$kind/$key"
  if complete "$out"; then report "cached build"; exit 0; fi
  mkdir -p "$cache_root/$kind"
  if command -v flock >/dev/null; then
    exec 9>"$cache_root/$kind/$key.lock"  # held until the script exits
    if ! flock -n 9; then
      echo "$name: another build of $key is running; waiting for it..." >&2
      flock 9
    fi
    # A run that waited finds what the other one built (also when it ended just before the lock).
    if complete "$out"; then report "cached build"; exit 0; fi
  else
    echo "$name: flock not found: builds started at once are not serialized" >&2
  fi
  tmp="$out.tmp.$$"
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp"
}

publish() {
  if complete "$out"; then
    rm -rf "$tmp"  # another build of the same inputs finished first: keep its files in place
  else
    rm -rf "$out" && mv "$tmp" "$out"
  fi
  report "built"
}
