#!/usr/bin/env bash
# Fails, printing file:line for each offence, when a tracked text file
#   - names a path outside the repository or a document that is not in it;
#   - cites docs/NAME.md (or a link from docs/ to NAME.md) that does not exist, or an anchor
#     (#name) that the document does not define;
#   - cites a section `§N` / `§N.M` that docs/pytorch-behaviour.md has no heading for, or uses
#     `§` without naming docs/pytorch-behaviour.md (the only document cited by section).
# Usage: repo_self_contained.sh [REPO_ROOT]   (default: the parent of this script's folder)
set -u
root=${1:-"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"}
cd "$root" || { echo "repo_self_contained: cannot enter '$root'"; exit 2; }
self=tests/repo_self_contained.sh
behaviour=docs/pytorch-behaviour.md

# Tracked files, or every file outside build output when this is not a git checkout.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t all < <(git ls-files)
else
  mapfile -t all < <(find . -path ./.git -prune -o -path './build*' -prune -o \
                       -name node_modules -prune -o -type f -print | sed 's|^\./||' | sort)
fi
candidates=()
for f in "${all[@]}"; do
  case "$f" in
    "$self" | data/* | fuzz/corpus/* | */node_modules/* | *.gz | *.pickle) continue ;;
  esac
  [[ -f "$f" ]] && candidates+=("$f")
done
files=()
((${#candidates[@]})) && mapfile -t files < <(grep -Il . -- "${candidates[@]}")  # text files only
if ((${#files[@]} == 0)); then
  echo "repo_self_contained: no files to check under $root"
  exit 2
fi

bad=0
report() {  # file line message
  echo "$1:$2: $3"
  bad=1
}

# 1. Paths outside the repository and documents that live elsewhere.
forbidden=('../shared' '/work/' 'shared/reference' 'shared/traces' 'DESIGN.md'
           'pytorch-allocator.md' 'perf-and-traces.md' 'peers.md')
args=()
for p in "${forbidden[@]}"; do args+=(-e "$p"); done
while IFS=: read -r f n text; do
  report "$f" "$n" "refers outside the repository: ${text:0:120}"
done < <(grep -nHF "${args[@]}" -- "${files[@]}")

# GitHub-style anchors of a markdown file: heading slugs and explicit ids.
anchors_of() {
  grep -E '^#+ ' "$1" | sed -E 's/^#+ +//' | tr '[:upper:]' '[:lower:]' |
    sed -E 's/[^a-z0-9 _-]//g; s/ /-/g'
  grep -oE '<a (id|name)="[^"]+"' "$1" | sed -E 's/.*="([^"]+)"/\1/'
}
check_doc() {  # file line target anchor
  if [[ ! -f "$3" ]]; then
    report "$1" "$2" "cites $3, which does not exist"
  elif [[ -n "$4" ]] && ! anchors_of "$3" | grep -qxF -- "$4"; then
    report "$1" "$2" "cites $3#$4, but $3 has no such heading or anchor"
  fi
}

# 2. docs/NAME.md[#anchor] anywhere, and relative NAME.md links inside docs/.
while IFS=: read -r f n ref; do
  check_doc "$f" "$n" "${ref%%#*}" "$([[ $ref == *'#'* ]] && echo "${ref#*#}")"
done < <(grep -noHE 'docs/[A-Za-z0-9_.-]+\.md(#[A-Za-z0-9_-]+)?' -- "${files[@]}")
for f in "${files[@]}"; do
  [[ $f == docs/*.md ]] || continue
  while IFS=: read -r n ref; do
    ref=${ref#"]("}
    check_doc "$f" "$n" "docs/${ref%%#*}" "$([[ $ref == *'#'* ]] && echo "${ref#*#}")"
  done < <(grep -noE '\]\([A-Za-z0-9_.-]+\.md(#[A-Za-z0-9_-]+)?' "$f")
done

# 3. Section citations: every `§N.M` must be a heading `### N.M ...` (`§N`: `## N. ...`) of
#    docs/pytorch-behaviour.md, and a file citing sections must name that document.
declare -A sections=()
if [[ -f $behaviour ]]; then
  while read -r num; do sections[$num]=1; done < <(
    grep -E '^##+ [0-9]+(\.[0-9]+)*\.? ' "$behaviour" |
      sed -E 's/^##+ ([0-9]+(\.[0-9]+)*)\.? .*/\1/')
fi
while IFS= read -r f; do
  names_doc=1
  [[ $f == "$behaviour" ]] || grep -qF 'pytorch-behaviour.md' "$f" || names_doc=0
  while IFS=: read -r n cite; do
    num=${cite#§}
    if ((names_doc == 0)); then
      report "$f" "$n" "cites §$num without naming $behaviour"
    elif [[ -z ${sections[$num]:-} ]]; then
      report "$f" "$n" "cites §$num, but $behaviour has no section $num"
    fi
  done < <(grep -noE '§[0-9]+(\.[0-9]+)*' "$f")
done < <(grep -lF '§' -- "${files[@]}")

if ((bad)); then
  echo "repo_self_contained: FAILED (each line above names a file:line to fix)"
  exit 1
fi
echo "repo_self_contained: ${#files[@]} files checked, all references resolve inside the repository"
