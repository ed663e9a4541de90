"""The POSIX sh programs `Node` runs on a machine (fleet/node/base.py), kept apart from the Python.

Each is passed whole to `sh -c PROGRAM NAME ARGS...`, so it works through any transport
(a local subprocess, one SSH exec) with its arguments quoted exactly once, and needs nothing
on the node beyond a POSIX shell, coreutils and /proc.
"""

from __future__ import annotations

__all__ = ["ALIVE", "DETACH", "KILL_STARTED", "LAUNCH", "READ_PID", "STATE", "STOP", "WATCH", "WRITE"]

# Started (by DETACH) as: setsid sh -c LAUNCH fleet-launch PIDFILE LOGFILE CWD ENVFILE -- ARGV...
# The environment comes from ENVFILE (0600, written through stdin, removed once opened), never
# from argv: `setsid sh -c … K=V` put every value (API keys, HF tokens) in /proc/*/cmdline,
# which every local user can read. The shell writes its own pid and start time (== the
# session and process group, thanks to setsid) to the pid file, then execs the command with
# stdio on the log, so the pid file names the real process and proves it is the same one.
LAUNCH = r"""
pidfile=$1; log=$2; cwd=$3; envfile=$4; shift 4
[ "$1" = "--" ] && shift
um=$(umask)
umask 077
if [ -n "$envfile" ]; then
  exec 3<"$envfile" || exit 96
  rm -f -- "$envfile"   # gone before it is read: a file the shell fails on is not left with its secrets
  set -a; . /dev/fd/3 || exit 96; set +a
  exec 3<&-
fi
mkdir -p -- "$(dirname -- "$pidfile")"
cd -- "$cwd" || exit 97
start=$(sed 's/^.*) //' "/proc/$$/stat" | cut -d' ' -f20)
tmp=$(mktemp "$pidfile.XXXXXX") || exit 98
echo "$$ $start" > "$tmp" && mv -f -- "$tmp" "$pidfile"
umask "$um"   # the command's own files (a job's output) follow the user's umask; ours are 0600
exec "$@" >>"$log" 2>&1 </dev/null
"""

# atomic_write PATH NBYTES < text: PATH written whole or not at all, 0600 (directories 0700): through a
# fresh temp file (mktemp: O_EXCL, never through a planted symlink), then a rename. The byte count
# matters: when the writer dies mid-send (Ctrl-C ends fleet with os._exit, kill -9, a dropped SSH
# connection) `cat` sees EOF early, and a cut-short launch record used to replace the good one
# (`fleet down` then missed that server). Shared by WRITE and DETACH (its env file).
_ATOMIC_WRITE = r"""
atomic_write() (
  umask 077
  mkdir -p -- "$(dirname -- "$1")" || exit 1
  tmp=$(mktemp "$1.XXXXXX") || exit 1
  if cat > "$tmp" && [ "$(wc -c < "$tmp")" -eq "$2" ] && mv -f -- "$tmp" "$1"; then exit 0; fi
  rm -f -- "$tmp"; exit 1
)
"""

# sh -c WRITE fleet-write PATH NBYTES [REMOVE...] < text: atomic_write, then the REMOVE files are
# removed (a start's job.json and its last run's exit file in one round trip).
WRITE = _ATOMIC_WRITE + r"""
atomic_write "$1" "$2" || exit 1
shift 2; [ $# -eq 0 ] || rm -f -- "$@" || exit 2
exit 0
"""

# sh -c DETACH LAUNCH PIDFILE LOGFILE CWD ENVFILE NBYTES -- ARGV...: remove PIDFILE, write ENVFILE
# (when not empty) from stdin with atomic_write, start LAUNCH in a new session and print "PID
# STARTTIME" of that session's leader (one round trip, not three: the multi-node controller starts a
# runner per chunk). LAUNCH execs the command, so that leader is the
# very process the pid file will name. Its stdio is the log from the first instruction: a launch
# shell that hangs or is stopped before its exec never holds the caller's pipes (which left
# `fleet`'s own wait on them unbounded, issue 23), and the caller knows what to kill when the
# pid file does not come in time. Not `setsid --fork`: its child's pid is unknown. A background
# job of a non-interactive shell is not a process-group leader, so `setsid` does not fork.
DETACH = _ATOMIC_WRITE + r"""
launch=$0; pidfile=$1; log=$2; cwd=$3; envfile=$4; nbytes=$5; shift 5
[ "$1" = "--" ] && shift
rm -f -- "$pidfile" || exit 95   # an old one is not taken for this start's
( umask 077; mkdir -p -- "$(dirname -- "$log")" && : >>"$log" ) || exit 95
if [ -n "$envfile" ]; then atomic_write "$envfile" "$nbytes" || exit 96; fi
setsid sh -c "$launch" fleet-launch "$pidfile" "$log" "$cwd" "$envfile" -- "$@" </dev/null >>"$log" 2>&1 &
pid=$!
start=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f20)
# bounded: up to 100 looks (≈ 2 s) for the pid file, so that the caller's first read finds it
i=0; while [ ! -s "$pidfile" ] && [ "$i" -lt 100 ]; do sleep 0.02 2>/dev/null; i=$((i + 1)); done
echo "$pid $start"
"""

# sh -c KILL_STARTED fleet-kill PID STARTTIME: SIGKILL the process group PID leads, only when
# PID is still the process that started at STARTTIME (a pid is reused once its process is gone).
# SIGKILL ends a stopped process too.
KILL_STARTED = r"""
[ -r "/proc/$1/stat" ] || exit 0
now=$(sed 's/^.*) //' "/proc/$1/stat" | cut -d' ' -f20)
[ "$now" = "$2" ] || exit 0
kill -KILL "-$1" 2>/dev/null || kill -KILL "$1" 2>/dev/null
exit 0
"""

# sh -c STOP fleet-stop PID GRACE_S: TERM the whole group, wait, then KILL.
# Prints "absent", "stopped" or "killed".
# No `kill --`: dash (Ubuntu's /bin/sh) rejects it, which silently spared the group.
# `running` scans /proc rather than `kill -0`: zombies do not count, because where pid 1
# does not reap orphans (many containers) a dead leader stays a zombie forever.
STOP = r"""
pg=$1; grace=$2
running() {
  for f in /proc/[0-9]*/stat; do
    { read -r s < "$f"; } 2>/dev/null || continue
    p=${s%% *}; set -- ${s##*) }
    [ "$1" != Z ] && { [ "$3" = "$pg" ] || [ "$p" = "$pg" ]; } && return 0
  done
  return 1
}
if ! running; then echo absent; exit 0; fi
kill -TERM "-$pg" 2>/dev/null || kill -TERM "$pg" 2>/dev/null
deadline=$(( $(date +%s) + ${grace%.*} ))
while running; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    kill -KILL "-$pg" 2>/dev/null || kill -KILL "$pg" 2>/dev/null; echo killed; exit 0
  fi
  sleep 0.1
done
echo stopped
"""

# sh -c READ_PID fleet-pid PIDFILE EXPECT: the pid, when the process it names is the one that
# wrote the file (same start time) and its command line holds EXPECT; nothing otherwise.
READ_PID = r"""
[ -f "$1" ] || exit 1
read -r pid start rest < "$1" || [ -n "$pid" ] || exit 1
case $pid in ''|*[!0-9]*) exit 1;; esac
if [ -n "$start" ] && [ -r "/proc/$pid/stat" ]; then
  now=$(sed 's/^.*) //' "/proc/$pid/stat" | cut -d' ' -f20)
  [ "$now" = "$start" ] || exit 3
fi
if [ -n "$2" ] && [ -r "/proc/$pid/cmdline" ]; then
  cmd=" $(tr '\0' ' ' < "/proc/$pid/cmdline")"
  case $cmd in *" $2 "*|*" $2") ;; *) exit 4;; esac
fi
echo "$pid"
"""

# sh -c ALIVE fleet-alive PID: 0 when the process exists and is not a zombie.
ALIVE = r"""
[ -r "/proc/$1/stat" ] || exit 1
state=$(sed 's/^.*) //' "/proc/$1/stat" | cut -c1)
[ "$state" != "Z" ] && [ "$state" != "X" ]
"""


# sh -c STATE fleet-state PID: "alive TICKS", "stopped TICKS" or "dead". Stopped (SIGSTOP) when the
# process or any process of the group it leads is: an engine's scheduler or engine-core child
# stopped serves nothing either, while its HTTP front looks alive. TICKS: the CPU time the group
# has used (utime, stime and its reaped children's, in clock ticks): the sign of life of a server
# whose first request is still out (fleet/smoke.py tells a hung one from one warming up by it).
STATE = r"""
cat /proc/[0-9]*/stat 2>/dev/null | awk -v pg="$1" '
{ pid = $1; s = $0; sub(/^.*\) /, "", s); split(s, f, " ")
  if (pid == pg) lead = f[1]
  if (pid == pg || f[3] == pg) { t += f[12] + f[13] + f[14] + f[15]; if (f[1] == "T" || f[1] == "t") st = 1 } }
END { if (lead == "" || lead == "Z" || lead == "X") print "dead"
      else if (st) printf "stopped %.0f\n", t
      else printf "alive %.0f\n", t }'
"""

# sh -c WATCH STATE PID FROM_BYTE LOG: the STATE word on line 1, then the log from FROM_BYTE.
WATCH = 'sh -c "$0" fleet-state "$1"; tail -c +"$2" "$3" 2>/dev/null'
