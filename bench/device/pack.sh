# bash bench/device/pack.sh NAME [REV]: archive REV (default HEAD) of the repo into .carry/NAME/tree.tar.xz for a device call.
set -e; mkdir -p .carry/$1; git archive --format=tar ${2:-HEAD} | xz -1 > .carry/$1/tree.tar.xz; ls -la .carry/$1
