# A GCS bucket for cloudckpt checkpoints, a Google service account with a role on that
# bucket only, and the Workload Identity binding that lets the training pods' Kubernetes
# service account act as it. See README.md.

resource "google_storage_bucket" "this" {
  # checkov:skip=CKV_GCP_78: versioning is a documented choice (var.versioning_enabled, off by default): checkpoints are immutable and written create-only.
  # checkov:skip=CKV_GCP_62: usage logging is optional (var.log_bucket): it needs a separate log bucket that this module does not own.
  project                     = var.project_id
  name                        = var.bucket_name
  location                    = var.location
  force_destroy               = var.force_destroy
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  labels                      = var.labels

  versioning {
    enabled = var.versioning_enabled
  }

  soft_delete_policy {
    retention_duration_seconds = var.soft_delete_retention_seconds
  }

  dynamic "encryption" {
    for_each = var.kms_key_name == null ? [] : [var.kms_key_name]
    content {
      default_kms_key_name = encryption.value
    }
  }

  dynamic "logging" {
    for_each = var.log_bucket == null ? [] : [var.log_bucket]
    content {
      log_bucket        = logging.value
      log_object_prefix = "gcs-usage/${var.bucket_name}"
    }
  }

  lifecycle_rule {
    condition {
      age = var.abort_incomplete_multipart_upload_days
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  dynamic "lifecycle_rule" {
    for_each = var.delete_checkpoints_after_days == null ? [] : [var.delete_checkpoints_after_days]
    content {
      condition {
        age            = lifecycle_rule.value
        matches_prefix = [var.checkpoint_prefix]
      }
      action {
        type = "Delete"
      }
    }
  }

  dynamic "lifecycle_rule" {
    for_each = var.versioning_enabled ? [1] : []
    content {
      condition {
        days_since_noncurrent_time = 7
      }
      action {
        type = "Delete"
      }
    }
  }
}

resource "google_service_account" "trainer" {
  project      = var.project_id
  account_id   = var.service_account_id
  display_name = "cloudckpt training jobs (${var.namespace}/${var.kubernetes_service_account})"
}

# Exactly what cloudckpt's storage layer calls through gcsfs: create-only uploads
# (ifGenerationMatch=0) and resumable uploads, whole and ranged reads and metadata,
# listings of a run and of a checkpoint, deletion (gc, rm, demo --overwrite).
resource "google_project_iam_custom_role" "checkpoints" {
  count       = var.use_custom_role ? 1 : 0
  project     = var.project_id
  role_id     = var.custom_role_id
  title       = "cloudckpt checkpoint writer"
  description = "Read, write, list and delete checkpoint objects (granted on one bucket only)."
  permissions = [
    "storage.objects.create",
    "storage.objects.delete",
    "storage.objects.get",
    "storage.objects.list",
  ]
}

# Granted on the bucket, not the project: the service account reaches no other bucket.
resource "google_storage_bucket_iam_member" "trainer" {
  bucket = google_storage_bucket.this.name
  role   = var.use_custom_role ? google_project_iam_custom_role.checkpoints[0].name : "roles/storage.objectAdmin"
  member = google_service_account.trainer.member
}

# Workload Identity: the Kubernetes service account namespace/name may act as the
# Google service account.
resource "google_service_account_iam_member" "workload_identity" {
  service_account_id = google_service_account.trainer.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${var.project_id}.svc.id.goog[${var.namespace}/${var.kubernetes_service_account}]"
}
