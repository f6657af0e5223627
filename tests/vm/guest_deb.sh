#!/bin/bash
# Guest side of tests/vm/test_deb_lab.py: the places a package install writes, made writable in the lab
# guest (whose root is the host's, read-only), and taken away again.
#   guest_deb.sh writable   tmpfs on /opt, /usr/share/doc, /usr/share/lintian; a tmpfs copy of /etc and of
#                           /usr/lib/systemd/system bound over them (overlayfs is a module the lab kernel
#                           has not got, and the lab fetches none); a copy of the host's dpkg database
#                           (hidden behind the guest's /var/lib tmpfs) for dpkg and apt to update; the
#                           image's policy-rc.d (which forbids starting services) hidden
#   guest_deb.sh restore    all of that undone, so later tests in the same guest see the lab as it was
set -euo pipefail
state=/run/lab/deb
case "${1:-}" in
writable)
    [ -e "$state/ready" ] && exit 0
    mkdir -p "$state"
    for d in /opt /usr/share/doc /usr/share/lintian; do
        mount -t tmpfs -o mode=0755 tmpfs "$d"
        # never empty: dpkg removes a folder it emptied, and this one is a mount point on a read-only root
        touch "$d/.lab-keep"
    done
    for d in /etc /usr/lib/systemd/system; do
        copy=$state/copy${d//\//_}
        mkdir -p "$copy"
        mount -t tmpfs -o mode=0755 tmpfs "$copy"
        cp -a "$d/." "$copy/"
        mount --bind "$copy" "$d"
    done
    # The machine's root is a container image's, whose policy-rc.d forbids every service action (exit
    # 101), so deb-systemd-invoke in the maintainer scripts would do nothing; a host has none. Hidden
    # here by a non-executable file over it (deb-systemd-invoke only runs an executable one).
    if [ -e /usr/sbin/policy-rc.d ]; then
        : > "$state/no-policy-rc.d"
        chmod 0644 "$state/no-policy-rc.d"
        mount --bind "$state/no-policy-rc.d" /usr/sbin/policy-rc.d
    fi
    # An earlier lab test may have installed the unit from the checkout (it would shadow the package's).
    rm -rf /etc/systemd/system/gthulhu-node.service /etc/systemd/system/gthulhu-node.service.d
    # Not recursive: the host's root without the guest's tmpfs mounts, so its /var/lib/dpkg shows.
    mkdir -p "$state/hostroot"
    mount --bind / "$state/hostroot"
    cp -a "$state/hostroot/var/lib/dpkg" /var/lib/dpkg
    umount "$state/hostroot"
    mkdir -p /var/lib/apt/lists/partial /var/cache/apt/archives/partial /var/log/apt
    systemctl daemon-reload
    touch "$state/ready"
    ;;
restore)
    [ -e "$state/ready" ] || exit 0
    if [ -e "$state/no-policy-rc.d" ]; then
        umount -l /usr/sbin/policy-rc.d
    fi
    for d in /etc /usr/lib/systemd/system /opt /usr/share/doc /usr/share/lintian; do
        umount -l "$d"
    done
    for d in /etc /usr/lib/systemd/system; do
        umount -l "$state/copy${d//\//_}"
    done
    rm -rf /var/lib/dpkg /var/lib/apt /var/lib/gthulhu-node "$state"
    systemctl daemon-reload
    ;;
*)
    sed -n '2,8p' "$0" >&2
    exit 2
    ;;
esac
