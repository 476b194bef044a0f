// How many CPUs this process may use (iq-cpu.h): the CPUs of its affinity mask (taskset,
// numactl, a container's cpuset), fewer where its cgroup's CPU quota (docker --cpus,
// Kubernetes limits) allows less time than that. More threads than this only take turns on
// the same CPUs.
//
// The quota is read along the process's cgroup path from /proc/self/cgroup, from its own
// cgroup up to the root, where any level may set one: cgroup v2 `cpu.max` ("QUOTA PERIOD" or
// "max PERIOD"), cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none) in the folder
// named after the controller list. The smallest ratio, rounded up, counts. $INNERQ_CGROUP_ROOT
// replaces /sys/fs/cgroup (tests give a quota that way).
#include "iq-cpu.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cpu_affinity_count(void) {
    for (size_t n = 1024; n <= (1u << 16); n *= 2) {
        cpu_set_t * set = CPU_ALLOC(n);
        if (set == NULL) {
            break;
        }
        const size_t size = CPU_ALLOC_SIZE(n);
        if (sched_getaffinity(0, size, set) == 0) {
            const int count = CPU_COUNT_S(size, set);
            CPU_FREE(set);
            return count;
        }
        CPU_FREE(set);
        if (errno != EINVAL) {  // EINVAL: the kernel's mask is larger than n CPUs
            break;
        }
    }
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 && n < INT_MAX ? (int) n : 1;
}

// The first line of a small file, or false.
static bool cpu_read_line(const char * path, char * buf, size_t size) {
    FILE * f = fopen(path, "re");
    if (f == NULL) {
        return false;
    }
    const bool ok = fgets(buf, (int) size, f) != NULL;
    fclose(f);
    return ok;
}

// CPUs the quota files in folder `dir` allow (rounded up), or INT_MAX where they set none.
static int cpu_quota_in(const char * dir, bool v2) {
    char path[PATH_MAX + 32], line[128];
    long long quota = -1, period = 0;
    if (v2) {
        char max[32];
        snprintf(path, sizeof(path), "%s/cpu.max", dir);
        if (cpu_read_line(path, line, sizeof(line)) && sscanf(line, "%31s %lld", max, &period) == 2 &&
            strcmp(max, "max") != 0) {
            quota = strtoll(max, NULL, 10);
        }
    } else {
        snprintf(path, sizeof(path), "%s/cpu.cfs_quota_us", dir);
        if (cpu_read_line(path, line, sizeof(line))) {
            quota = strtoll(line, NULL, 10);
        }
        snprintf(path, sizeof(path), "%s/cpu.cfs_period_us", dir);
        if (quota > 0 && cpu_read_line(path, line, sizeof(line))) {
            period = strtoll(line, NULL, 10);
        }
    }
    if (quota <= 0 || period <= 0) {
        return INT_MAX;
    }
    const long long n = (quota + period - 1) / period;
    return n < INT_MAX ? (int) n : INT_MAX;
}

// The smallest quota from root/sub up to root.
static int cpu_quota_along(const char * root, const char * sub, bool v2) {
    char dir[PATH_MAX];
    if (snprintf(dir, sizeof(dir), "%s%s", root, sub) >= (int) sizeof(dir)) {
        return INT_MAX;
    }
    const size_t root_len = strlen(root);
    int n = INT_MAX;
    for (;;) {
        const int q = cpu_quota_in(dir, v2);
        n = q < n ? q : n;
        char * slash = strrchr(dir, '/');
        if (slash == NULL || (size_t) (slash - dir) < root_len) {
            return n;
        }
        *slash = '\0';
    }
}

// Whether the comma-separated controller list names "cpu".
static bool cpu_has_controller(const char * list) {
    for (const char * p = list; *p;) {
        const size_t len = strcspn(p, ",");
        if (len == 3 && strncmp(p, "cpu", 3) == 0) {
            return true;
        }
        p += len + (p[len] == ',');
    }
    return false;
}

static int cpu_quota_count(void) {
    const char * root = getenv("INNERQ_CGROUP_ROOT");
    root = root != NULL && root[0] != '\0' ? root : "/sys/fs/cgroup";
    FILE * f = fopen("/proc/self/cgroup", "re");
    if (f == NULL) {
        return INT_MAX;
    }
    int n = INT_MAX;
    char line[PATH_MAX + 128];
    while (fgets(line, sizeof(line), f) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        // "ID:CONTROLLERS:PATH"; v2 is "0::PATH"
        char * c1 = strchr(line, ':');
        char * c2 = c1 != NULL ? strchr(c1 + 1, ':') : NULL;
        if (c2 == NULL) {
            continue;
        }
        *c2 = '\0';
        const char * controllers = c1 + 1;
        const char * path = strcmp(c2 + 1, "/") == 0 ? "" : c2 + 1;
        int q = INT_MAX;
        if (controllers[0] == '\0') {
            q = cpu_quota_along(root, path, true);
        } else if (cpu_has_controller(controllers)) {
            char dir[PATH_MAX];
            if (snprintf(dir, sizeof(dir), "%s/%s", root, controllers) < (int) sizeof(dir)) {
                q = cpu_quota_along(dir, path, false);
            }
        }
        n = q < n ? q : n;
    }
    fclose(f);
    return n;
}

int iq_cpu_count(void) {
    const int affinity = cpu_affinity_count();
    const int quota = cpu_quota_count();
    const int n = quota < affinity ? quota : affinity;
    return n > 0 ? n : 1;
}
