# An S3 bucket for cloudckpt checkpoints, a least-privilege IAM policy for the training
# jobs and an IRSA role for EKS. See README.md for why each setting is what it is.

locals {
  prefix_arn = "${aws_s3_bucket.this.arn}/${var.checkpoint_prefix}*"
  use_kms    = var.kms_key_arn != null
}

resource "aws_s3_bucket" "this" {
  # checkov:skip=CKV_AWS_144: cross-region replication doubles the cost of every checkpoint; a run can be restarted from an older checkpoint, and replication is the operator's choice per bucket.
  # checkov:skip=CKV2_AWS_62: no consumer of event notifications; training jobs find checkpoints with cloudckpt.latest.
  # checkov:skip=CKV_AWS_18: access logging is optional (var.access_log_bucket): it needs a separate log bucket that this module does not own.
  # checkov:skip=CKV_AWS_21: versioning is a documented choice (var.versioning_enabled, off by default): checkpoints are immutable and written create-only.
  # checkov:skip=CKV_AWS_145: SSE-KMS is optional (var.kms_key_arn); the default is SSE-S3, which needs no key policy.
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket                  = aws_s3_bucket.this.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

# ACLs disabled: the bucket owner owns every object, access is by IAM policy only.
resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = local.use_kms ? "aws:kms" : "AES256"
      kms_master_key_id = var.kms_key_arn
    }
    # An S3 bucket key cuts KMS requests (one per object otherwise; a checkpoint has thousands).
    bucket_key_enabled = local.use_kms
  }
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id
  versioning_configuration {
    # "Suspended" rather than "Disabled" so that switching versioning off again works too;
    # on a bucket that never had versioning both behave alike.
    status = var.versioning_enabled ? "Enabled" : "Suspended"
  }
}

resource "aws_s3_bucket_logging" "this" {
  count         = var.access_log_bucket == null ? 0 : 1
  bucket        = aws_s3_bucket.this.id
  target_bucket = var.access_log_bucket
  target_prefix = "s3-access/${var.bucket_name}/"
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  # A killed rank leaves its open multipart uploads behind; their parts cost storage but
  # are invisible to listings. cloudckpt gc also aborts them (after its grace period).
  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"
    filter {}
    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_upload_days
    }
  }

  dynamic "rule" {
    for_each = var.expire_checkpoints_after_days == null ? [] : [var.expire_checkpoints_after_days]
    content {
      id     = "expire-old-checkpoints"
      status = "Enabled"
      filter {
        prefix = var.checkpoint_prefix
      }
      expiration {
        days = rule.value
      }
    }
  }

  dynamic "rule" {
    for_each = var.versioning_enabled ? [var.noncurrent_version_expiration_days] : []
    content {
      id     = "expire-noncurrent-versions"
      status = "Enabled"
      filter {}
      noncurrent_version_expiration {
        noncurrent_days = rule.value
      }
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

# TLS only: deny every request over plain HTTP.
data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this.arn,
      "${aws_s3_bucket.this.arn}/*",
    ]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket     = aws_s3_bucket.this.id
  policy     = data.aws_iam_policy_document.bucket.json
  depends_on = [aws_s3_bucket_public_access_block.this]
}

# Exactly the S3 actions cloudckpt's storage layer calls (cloudckpt/storage.py), scoped
# to the checkpoint prefix. README.md lists which operation needs which action.
data "aws_iam_policy_document" "checkpoints" {
  statement {
    sid       = "ListCheckpointPrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.checkpoint_prefix, "${var.checkpoint_prefix}*"]
    }
  }

  statement {
    sid       = "ListOpenMultipartUploads"
    actions   = ["s3:ListBucketMultipartUploads"]
    resources = [aws_s3_bucket.this.arn]
  }

  statement {
    sid = "ReadWriteDeleteCheckpoints"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
    ]
    resources = [local.prefix_arn]
  }

  dynamic "statement" {
    for_each = local.use_kms ? [var.kms_key_arn] : []
    content {
      sid       = "UseCheckpointKmsKey"
      actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_policy" "checkpoints" {
  name        = "${var.role_name}-checkpoints"
  description = "cloudckpt: read, write and delete checkpoints under s3://${var.bucket_name}/${var.checkpoint_prefix}"
  policy      = data.aws_iam_policy_document.checkpoints.json
  tags        = var.tags
}

# IRSA: pods of the service account namespace/service_account assume this role with
# their projected web-identity token.
data "aws_iam_policy_document" "irsa_trust" {
  count = var.create_irsa_role ? 1 : 0

  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${trimprefix(var.oidc_provider_url, "https://")}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${var.service_account}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${trimprefix(var.oidc_provider_url, "https://")}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "irsa" {
  count                = var.create_irsa_role ? 1 : 0
  name                 = var.role_name
  description          = "cloudckpt training pods (${var.namespace}/${var.service_account}) via IRSA"
  assume_role_policy   = data.aws_iam_policy_document.irsa_trust[0].json
  max_session_duration = 3600
  tags                 = var.tags

  lifecycle {
    precondition {
      condition     = var.oidc_provider_arn != null && var.oidc_provider_url != null
      error_message = "create_irsa_role needs oidc_provider_arn and oidc_provider_url."
    }
  }
}

resource "aws_iam_role_policy_attachment" "irsa" {
  count      = var.create_irsa_role ? 1 : 0
  role       = aws_iam_role.irsa[0].name
  policy_arn = aws_iam_policy.checkpoints.arn
}
