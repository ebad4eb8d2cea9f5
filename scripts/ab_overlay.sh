# An A/B variant for scripts/device_probes.sh, made here (the device's copy has no git): the
# files under strata/ that changed between REV and HEAD, as they were at REV, in .ab/NAME/ at
# their repo paths (an ignored folder: carry ".ab" with the device call). Files added since
# REV stay in the copy (REV's files do not import them).
# Usage: bash scripts/ab_overlay.sh REV NAME   (then AB="NAME kept kept NAME" on the device)
set -euo pipefail
rev=$1 name=$2
grep -qx "/.ab/" .git/info/exclude 2>/dev/null || echo "/.ab/" >> .git/info/exclude
rm -rf ".ab/$name"
for f in $(git diff --name-only --diff-filter=MD "$rev" HEAD -- strata); do
  mkdir -p ".ab/$name/$(dirname "$f")"
  git show "$rev:$f" > ".ab/$name/$f"
done
find ".ab/$name" -type f | sort
