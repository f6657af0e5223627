#!/bin/bash
# PID 1 of the lab guest (kernel command line: init=<this file>).
#
# The root filesystem is the host's / over virtiofs, mounted read-only: every place the guest must write
# gets a tmpfs here, so nothing the guest does can reach the host's files. The harness (tests/vm/lab.py)
# passes its settings as lab.* words on the kernel command line:
#   lab.mode=agent|shell|systemd  what to run once the mounts are up
#   lab.repo=PATH      the repository, shared again (read-only, tag "repo") because it may live under a
#                      folder that gets a tmpfs here (/tmp, /var/tmp)
#   lab.scratch=PATH   the per-boot scratch folder, shared read-write (tag "scratch"), same path as on the host
#   lab.kroot=PATH     the unpacked lab kernel in the host's cache (kept visible across the /var/cache tmpfs);
#                      /lib/modules/$(uname -r)/{build,source} link to its headers
#   lab.rows=N lab.cols=N  terminal size for the interactive shell
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8

say() { echo "lab-init: $*" >/dev/console 2>/dev/null || echo "lab-init: $*"; }

# (No `mountpoint` tests: through virtiofs every host folder that is a mount point on the host looks like one.)
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
grep -q "^devtmpfs /dev " /proc/mounts || mount -t devtmpfs -o mode=0755,nosuid devtmpfs /dev
exec </dev/console >/dev/console 2>&1

mode=agent repo="" scratch="" kroot="" rows="" cols=""
for word in $(cat /proc/cmdline); do
    case "$word" in
        lab.mode=*) mode=${word#lab.mode=} ;;
        lab.repo=*) repo=${word#lab.repo=} ;;
        lab.scratch=*) scratch=${word#lab.scratch=} ;;
        lab.kroot=*) kroot=${word#lab.kroot=} ;;
        lab.rows=*) rows=${word#lab.rows=} ;;
        lab.cols=*) cols=${word#lab.cols=} ;;
    esac
done

mkdir -p /dev/pts /dev/shm /dev/mqueue
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
mount -t mqueue mqueue /dev/mqueue 2>/dev/null
[ -e /dev/ptmx ] || ln -s pts/ptmx /dev/ptmx
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd

mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mkdir -p /run/lab /run/lock

# The kernel tree lives in the host's cache (under /var/cache, which gets a tmpfs below): park it in /run
# and move it back to its own path afterwards; the header tree's symlinks use that absolute path.
if [ -n "$kroot" ] && [ -d "$kroot" ]; then
    mkdir -p /run/lab/kroot
    mount --bind "$kroot" /run/lab/kroot
    mount -o remount,bind,ro /run/lab/kroot
fi

mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /var/tmp
for dir in /var/log /var/cache /var/lib /root; do
    mount -t tmpfs -o mode=0755 tmpfs "$dir"
done
# Tools look for their state folders; recreate the empty skeletons they expect.
mkdir -p /var/lib/systemd /var/lib/dbus /var/lib/misc /var/cache/ldconfig /var/log/journal

mount -t bpf -o mode=0700 bpf /sys/fs/bpf
mount -t tracefs tracefs /sys/kernel/tracing
mount -t debugfs debugfs /sys/kernel/debug
mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup
mount -t configfs configfs /sys/kernel/config 2>/dev/null

if grep -q " /run/lab/kroot " /proc/mounts; then
    mkdir -p "$kroot"
    mount --move /run/lab/kroot "$kroot"
fi

# /lib/modules/<release>/{build,source} -> the lab kernel's header trees (where BCC and kbuild look).
# The package's own links are relative to its unpack folder, so they are resolved there.
if [ -d /usr/lib/modules ] && [ -n "$kroot" ]; then
    mount -t tmpfs -o mode=0755 tmpfs /usr/lib/modules
    release=$(uname -r)
    mkdir -p "/usr/lib/modules/$release"
    for link in build source; do
        target=$(readlink -f "$kroot/usr/lib/modules/$release/$link") && ln -s "$target" "/usr/lib/modules/$release/$link"
    done
fi

if [ -n "$repo" ]; then
    mkdir -p "$repo"
    mount -t virtiofs -o ro repo "$repo" || say "cannot mount the repository share at $repo"
fi
if [ -n "$scratch" ]; then
    mkdir -p "$scratch"
    mount -t virtiofs scratch "$scratch" || say "cannot mount the scratch share at $scratch"
fi

hostname gthulhu-lab
ip link set lo up 2>/dev/null
# Info-level kernel messages to the console (the boot itself ran with `quiet`): sched_ext explains
# there why it ejected a scheduler, and the harness keeps the console.
echo 6 >/proc/sys/kernel/printk
say "mounts ready at uptime $(cut -d" " -f1 /proc/uptime) s, mode=$mode"

agent="$repo/tests/vm/guest_agent.py"
case "$mode" in
    shell)
        [ -n "$rows" ] && [ -n "$cols" ] && stty -F /dev/ttyS0 rows "$rows" cols "$cols"
        cd "${repo:-/}" || cd /
        echo "gthulhu lab: kernel $(uname -r), sched_ext $(cat /sys/kernel/sched_ext/state 2>/dev/null)."
        echo "Root is the host's / (read-only); /tmp and /root are tmpfs. Exit the shell to power off."
        TERM=${TERM:-linux} setsid -c /bin/bash -l </dev/ttyS0 >/dev/ttyS0 2>&1
        ;;
    systemd)
        /bin/bash "$repo/tests/vm/guest_systemd.sh" "$repo" "$agent"
        # Empty $container: this is a VM, although the host's / carries a /.dockerenv.
        exec env container= /lib/systemd/systemd
        ;;
    *)
        cd /
        /usr/bin/python3 "$agent"
        say "agent exited with status $?"
        ;;
esac
sync
echo o >/proc/sysrq-trigger
sleep 60
