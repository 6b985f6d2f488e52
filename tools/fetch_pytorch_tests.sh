#!/usr/bin/env bash
# PyTorch 2.6.0's Inductor tests, for tools/conformance.py and the device's
# upstream-tests step (scripts/gpu/conformance.sh):
#   bash tools/fetch_pytorch_tests.sh [DEST]     (default .pytorch_tests)
#   python tools/conformance.py --test-dir .pytorch_tests/test/inductor ...
# Debian's source package holds the test tree that PyPI's wheels leave out;
# 2.6.0 is the newest release its pool keeps.  DEST is for measuring only:
# keep it out of git (.git/info/exclude) and carry it to the device.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.pytorch_tests}
url=https://deb.debian.org/debian/pool/main/p/pytorch/pytorch_2.6.0+dfsg.orig.tar.xz
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching $url (27 MB)"
curl -fsSL "$url" | tar -xJ -C "$tmp" --wildcards 'pytorch-v2.6.0/test/*'
mkdir -p "$dest/test"
# test/inductor imports test_autograd (compiled autograd's tests), which
# imports autograd/ and test_custom_ops; the failures file is read at import.
for path in inductor autograd test_autograd.py test_custom_ops.py minioptest_failures_dict.json; do
    rm -rf "${dest:?}/test/$path"
    cp -a "$tmp/pytorch-v2.6.0/test/$path" "$dest/test/"
done
cp tools/pytorch_2_6_conftest.py "$dest/test/inductor/conftest.py"
du -sh "$dest"
