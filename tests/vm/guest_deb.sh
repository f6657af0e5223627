#!/bin/bash
# Guest side of tests/vm/test_deb_lab.py: the places a package install writes, made writable in the lab
# guest (whose root is the host's, read-only), and taken away again.
#   guest_deb.sh writable TAR   tmpfs on /opt, /usr/share/doc, /usr/share/lintian; tmpfs copies of /etc
#                               and /usr/lib/systemd/system bound over them (overlayfs is a module the lab
#                               kernel has not got, and the lab fetches none); a copy of the host's dpkg
#                               database (hidden behind the guest's /var/lib tmpfs) for dpkg and apt to
#                               update; the image's policy-rc.d (which forbids starting services) hidden.
#                               TAR: the host's copy of those three folders (test_deb_lab.py writes it)
#   guest_deb.sh restore        all of that undone, so later tests in the same guest see the lab as it was
set -euo pipefail
state=/run/lab/deb
case "${1:-}" in
writable)
    [ -e "$state/ready" ] && exit 0
    mkdir -p "$state"
    for d in /opt /usr/share/doc /usr/share/lintian; do
        mount -t tmpfs -o mode=0755 tmpfs "$d"
    done
    # The copies come from one tar the host wrote into the scratch share ($2): copying the folders file
    # by file through virtiofs took two minutes of the emulated guest's time, extracting one file seconds.
    base=${2:?usage: guest_deb.sh writable TAR}
    for d in /etc /usr/lib/systemd/system; do
        copy=$state/copy${d//\//_}
        mkdir -p "$copy"
        mount -t tmpfs -o mode=0755 tmpfs "$copy"
        rel=${d#/}
        tar -xf "$base" -C "$copy" --strip-components="$(tr -cd / <<<"$rel/" | wc -c)" "$rel"
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
    # The host's dpkg database (hidden behind the guest's /var/lib tmpfs), for dpkg and apt to update.
    tar -xf "$base" -C / var/lib/dpkg
    # dpkg removes a folder its last package leaves empty: /opt here is a mount point on a read-only root
    # (rmdir fails with EROFS, which dpkg does not forgive, as the test's second run showed). Listed as
    # base-files' in this copy of the database, it is a shared folder dpkg leaves alone.
    grep -qx /opt /var/lib/dpkg/info/base-files.list || echo /opt >> /var/lib/dpkg/info/base-files.list
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
