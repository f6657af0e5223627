#!/bin/bash
# Prepare the lab guest for systemd as PID 1 (run by guest_init.sh in lab.mode=systemd, right before it
# execs /lib/systemd/systemd). guest_init.sh already put tmpfs on /run, /tmp, /var/{tmp,log,cache,lib}.
#
# /etc is the host's, read-only. systemd needs a writable /etc/systemd/system (units the tests install,
# `systemctl enable`, masks); without overlayfs (a module this kernel lacks) the way is a tmpfs holding a
# copy of the host's folder, so the host's own units and enablement still apply.
# Usage: guest_systemd.sh REPO AGENT
set -u
repo=$1
agent=$2
units=/etc/systemd/system

mkdir -p /run/lab/units
mount -t tmpfs -o mode=0755 tmpfs /run/lab/units
cp -a "$units/." /run/lab/units/ 2>/dev/null
mount --move /run/lab/units "$units"

cat >"$units/gthulhu-lab-agent.service" <<EOF
[Unit]
Description=gthulhu lab guest agent (runs the harness's commands)
DefaultDependencies=no
After=systemd-journald.socket
Before=sysinit.target

[Service]
ExecStart=/usr/bin/python3 $agent
Restart=always
RestartSec=1
KillMode=process
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=sysinit.target
EOF
mkdir -p "$units/sysinit.target.wants"
ln -sf "$units/gthulhu-lab-agent.service" "$units/sysinit.target.wants/gthulhu-lab-agent.service"

# Units that fail here (no network, no udev, no real disks, read-only /var content) or only slow the boot.
for unit in \
    getty@tty1.service serial-getty@ttyS0.service console-getty.service getty-static.service \
    systemd-timesyncd.service systemd-pstore.service systemd-networkd.service \
    systemd-networkd-wait-online.service systemd-resolved.service networking.service \
    systemd-remount-fs.service systemd-fsck-root.service e2scrub_reap.service e2scrub_all.service \
    postgresql.service ssh.service cron.service rsyslog.service \
    apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer fstrim.timer \
    man-db.timer logrotate.timer systemd-tmpfiles-clean.timer \
    systemd-update-utmp.service systemd-update-utmp-runlevel.service \
    systemd-binfmt.service proc-sys-fs-binfmt_misc.automount \
    systemd-firstboot.service systemd-hwdb-update.service ldconfig.service \
    systemd-journal-catalog-update.service systemd-update-done.service \
    systemd-random-seed.service systemd-machine-id-commit.service \
    sys-kernel-config.mount dev-hugepages.mount dev-mqueue.mount \
    remote-fs.target; do
    ln -sf /dev/null "$units/$unit"
done
exit 0
