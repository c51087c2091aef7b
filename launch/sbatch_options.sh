# The sbatch options a submit script does not take itself (sourced by launch/submit.sh and
# launch/submit_preprocess.sh): any other long option passes through to sbatch as given,
# `--qos=high` or `--qos high`. A word after such an option is its value unless it starts with `-`
# (write `--opt=-x` for such a value); a flag such as --exclusive takes none. Refused with one line,
# exit 2: short options (give the long form), and those the script's own `refused OPTION` names
# (it prints why: options the script sets under its own name, or that do not describe its job).
#
#   case "$1" in
#     ...the script's own options...
#     -?*) take_sbatch_option "$@"; shift "$taken" ;;   # appends to the array `passed`
#   esac

# take_sbatch_option ARGS...: $1 is an option the script does not take; append it (and its value,
# the next word where it has one) to the caller's array `passed` and set `taken` to the words it
# used, 1 or 2. Needs the caller's `usage` (its one-line usage) and `refused` function.
take_sbatch_option() {
  local why
  case "$1" in
    --?*) ;;
    *) echo "error: short option $1: give sbatch options in their long form (e.g. --qos=high for -q high); $usage" >&2; exit 2 ;;
  esac
  why=$(refused "${1%%=*}")
  [ -z "$why" ] || { echo "error: $why" >&2; exit 2; }
  if [[ "$1" != *=* ]] && [ $# -gt 1 ] && [[ "$2" != -* ]]; then passed+=("$1" "$2"); taken=2
  else passed+=("$1"); taken=1; fi
}
